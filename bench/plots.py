"""What the benchmarks share to draw their figures."""


def pyplot():
    """matplotlib's pyplot drawing to files, or None where matplotlib is not installed: it comes
    with `python3 -m course setup --notebooks`, and a benchmark's figures are in its JSON anyway."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
