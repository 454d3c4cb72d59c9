"""Training code as users bring it: a stock Ray Train script, and a train function for --train-func."""
