"""Functions over lists of gradients: overflow checks, norms and clipping, the underflow meter, the
agreement of ranks under torch.distributed, and the masked skip."""
