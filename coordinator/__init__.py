"""Everything that drives stages and shows results."""
