"""Reference models. Each builder returns an nn.Module; see configs/models/*.yaml for their specs."""
