"""The torch side of the Lightning adapter: probes, reductions and the step record."""
