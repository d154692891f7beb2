"""Models nobody here wrote (Hugging Face transformers, random init from tiny configs, no
network; GPT-2 given to Varuna as it is, the others in the module a script wraps them in) and
hand-written GPT code as users write it, with the plain single-process PyTorch loop every P x D
run of them must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint

STEPS, BATCH, CHUNK = 5, 8, 2
VOCAB, SEQ = 64, 16
HF = ("llama", "gpt2", "gpt2_sft", "bert", "resnet")
# trained on prompts and padding labelled -100: its loss is a mean over the other tokens, so each
# micro-batch must weigh its tokens, and the plain loop is one full-batch step; each global batch
# is padded to its own longest sequence, so the length differs from step to step
TOKEN_MEAN = ("gpt2_sft",)
GPT = ("gpt_tied", "gpt_shared")
SHARED = {"gpt_shared": [("wte.weight", "lm_head.weight")]}


class LossOf(nn.Module):
    """What a user writes around a Hugging Face model: forward(batch) -> loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


class ImageLossOf(LossOf):
    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values, labels=labels).loss


class Block(nn.Module):
    """GPT block as most GPT code writes it: the mask from the input's shape."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        t = x.size(1)
        mask = torch.tril(torch.ones(t, t, device=x.device)).view(1, 1, t, t)
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.heads, C // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // self.heads) ** 0.5)
        att = F.softmax(att.masked_fill(mask == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class HandGPT(nn.Module):
    """Position ids from the input's shape, CutPoints between blocks, and a head tied to the
    embedding either as one Parameter (`tie="same"`) or as two named in shared_weights (which
    also writes in place on each cut's output)."""

    def __init__(self, tie: str, d: int = 32, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(layers - 1))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.writes_after_cut = tie == "two"
        if tie == "same":
            self.lm_head.weight = self.wte.weight
        else:
            with torch.no_grad():
                self.lm_head.weight.copy_(self.wte.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.size()
        pos = torch.arange(0, t, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(pos)
        for i, block in enumerate(self.blocks):
            if i:
                x = self.cuts[i - 1](x)
                if self.writes_after_cut:   # in place, on what a later stage receives (failed at P > 1)
                    x[:, :1] *= 0.5
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        # nanoGPT's loss: targets padded with -1 past each row's end are no tokens of the mean
        return F.cross_entropy(logits.view(b * t, -1), labels.view(-1), ignore_index=-1)


def build(name: str) -> nn.Module:
    import transformers as tf
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "llama":
        return LossOf(tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False, **ids)))
    if name in ("gpt2", "gpt2_sft"):   # as it is, unwrapped: its output holds the loss, the logits and its cache
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    if name == "bert":
        bert = tf.BertForMaskedLM(tf.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0))
        # partial fine-tuning: the word embeddings (tied to the MLM head) and the first layer
        # frozen. A frozen tensor failed every D > 1 run, and a frozen tied one got a zero
        # gradient at P > 1, which weight decay still applied (optimizer() decays bert's).
        bert.bert.embeddings.word_embeddings.weight.requires_grad_(False)
        bert.bert.encoder.layer[0].requires_grad_(False)
        return LossOf(bert)
    if name == "resnet":
        return ImageLossOf(tf.ResNetForImageClassification(tf.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], num_labels=5)))
    if name in GPT:
        return HandGPT("same" if name == "gpt_tied" else "two")
    raise ValueError(name)


def global_batch(name: str, step: int, size: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 7)
    if name == "resnet":
        return {"pixel_values": torch.randn(size, 3, 64, 64, generator=g),
                "labels": torch.randint(0, 5, (size,), generator=g)}
    x = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    if name in TOKEN_MEAN:   # a prompt of 2-7 tokens and an answer of 1-8, then padding: -100 outside the answer
        prompt = torch.randint(2, 8, (size, 1), generator=g)
        end = prompt + torch.randint(1, 9, (size, 1), generator=g)
        at = torch.arange(SEQ)
        # padded to the batch's longest, as a collator pads: the length changes from step to step
        longest = int(end.max())
        return {"input_ids": x[:, :longest], "labels": torch.where((at >= prompt) & (at < end), x, -100)[:, :longest]}
    if name in GPT:   # next-token targets, padded with -1 past each row's end (4 to SEQ tokens)
        ends = torch.randint(4, SEQ + 1, (size, 1), generator=g)
        return {"input_ids": x, "labels": torch.where(torch.arange(SEQ) < ends, torch.roll(x, -1, 1), -1)}
    # labels everywhere (no -100): every micro-batch's mean is over the same number of tokens
    return {"input_ids": x, "labels": x}


def sample_batch_fn(name: str):
    def get_batch_fn(size, device):
        return {k: v.to(device) for k, v in global_batch(name, 99, size).items()}
    return get_batch_fn


def optimizer(params, name: str = "") -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=0.05 if name == "bert" else 0.0)


def reference(name: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop: micro-batches of CHUNK consecutive examples (BatchNorm sees what each
    stage sees), gradients accumulated, one optimizer step per global batch; for a loss averaged
    over tokens (TOKEN_MEAN, and the hand GPTs' padded targets), the whole global batch at once."""
    model = build(name)
    model.train()
    opt = optimizer(model.parameters(), name)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        batch, total = global_batch(name, step), 0.0
        whole = name in TOKEN_MEAN or name in GPT
        if whole:   # the global batch's token mean, as one process computes it
            out = model(**batch)
            loss = getattr(out, "loss", out)
            loss.backward()
            total = loss.item()
        for start in range(0, BATCH, CHUNK) if not whole else ():
            out = model(**{k: v[start:start + CHUNK] for k, v in batch.items()})
            loss = getattr(out, "loss", out) * (CHUNK / BATCH)
            loss.backward()
            total += loss.item()
        if name == "gpt_shared":   # what shared_weights means: the two copies are one weight
            grad = model.wte.weight.grad + model.lm_head.weight.grad
            model.wte.weight.grad, model.lm_head.weight.grad = grad, grad.clone()
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
