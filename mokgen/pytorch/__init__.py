"""The PyTorch-facing layer: the compiled layer a user calls (api), its torch.library ops and
autograd (ops), and the nn.Module (module)."""
