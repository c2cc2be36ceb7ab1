"""Command-line entry points, one per stage (``python -m jobs.<stage>``), plus the miniature end-to-end run."""
