"""GradReducer alone: two replicas in forked processes over a real gloo group on loopback.

Each replica holds an embedding and a head that are one tensor in the math (two Parameters,
Varuna's `shared_weights` way) plus an untied layer, on one stage: the P = 1, D = 2 case in
which the overlapped bucket all-reduce once wrote the un-summed gradients over the tied sum.


The in-process tests of tests/integration/test_data_parallel.py (tests/README.md).
"""


import pytest
import torch
from torch import nn

from trainer.engine.data_parallel import GradReducer


def test_a_parameter_in_two_tied_sets_is_refused():
    shared = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="two tied sets"):
        GradReducer([shared], None, 1, tied=[([shared, nn.Parameter(torch.zeros(2))], None),
                                             ([shared, nn.Parameter(torch.zeros(2))], None)])
