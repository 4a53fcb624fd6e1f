"""`python -m gpusched_router`: run the router with settings from the environment."""

from gpusched_common.web import run_service
from gpusched_router.main import create_app
from gpusched_router.settings import RouterSettings

if __name__ == "__main__":
    run_service("router", RouterSettings, create_app)
