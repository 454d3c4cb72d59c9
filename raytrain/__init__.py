"""raytrain: PyTorch training across a SLURM allocation with Ray Train."""

__version__ = "0.1.0"
