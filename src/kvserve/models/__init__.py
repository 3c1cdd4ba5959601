"""Model implementations (plain PyTorch)."""
