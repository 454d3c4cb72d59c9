"""The built-in recipe: image classification from Parquet with a torchvision model (``raytrain fit``).

A ``raytrain.Workload`` like any user's: it imports raytrain's public API and the shared contracts,
never ``raytrain.service`` or ``raytrain.launch`` (a test keeps it so).
"""
