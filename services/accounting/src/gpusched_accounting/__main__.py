"""`python -m gpusched_accounting`: run accounting with settings from the environment."""

from gpusched_accounting.main import create_app
from gpusched_accounting.settings import AccountingSettings
from gpusched_common.web import run_service

if __name__ == "__main__":
    run_service("accounting", AccountingSettings, create_app)
