"""Every byte that crosses a process boundary in varunad: messages, tensor frames, CURVE security."""
