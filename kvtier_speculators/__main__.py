"""``python -m kvtier_speculators train ...``: Speculators' command line with kvtier's backend
registered first, so that ``--hidden-states-backend kvtier`` and its ``--kvtier-*`` arguments
exist (Speculators collects the backends' arguments when its configuration is imported)."""

import kvtier_speculators  # noqa: F401

if __name__ == "__main__":
    from speculators.cli import app  # only once the backend is registered

    app()
