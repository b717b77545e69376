"""speedbench: measure which PyTorch training speed-up techniques pay off on your hardware."""

__version__ = "0.1.0"
