"""Functions over lists of gradients: overflow checks, norms and clipping, the underflow meter, the
agreement of ranks under torch.distributed, and the masked skip; and the marks of the modules keep_float32 keeps
(``kept.py``), which per-layer scales read."""
