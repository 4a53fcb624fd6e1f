"""`python -m gpusched_accounting`: run accounting with settings from the environment."""

import gc

from gpusched_accounting.main import create_app
from gpusched_accounting.settings import AccountingSettings
from gpusched_common.web import serve

if __name__ == "__main__":
    settings = AccountingSettings()
    gc.set_threshold(settings.gc_young_threshold, 50, 100)  # older generations: less often too
    serve(create_app(settings), settings)
