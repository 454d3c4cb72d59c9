"""The contracts between raytrain's processes, each written once and imported everywhere it is used.

``env``: every environment variable raytrain reads or sets, with its default and meaning;
``jobdir``: the files in a Slurm job's private directory and the Ray node label; ``metrics``: the keys
training reports carry; ``result``: the ``result.json`` schema. Nothing here imports Ray or torch.
"""
