"""Everything that runs inside one stage process."""
