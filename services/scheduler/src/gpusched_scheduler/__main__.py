"""`python -m gpusched_scheduler`: run the scheduler with settings from the environment."""

from gpusched_common.web import run_service
from gpusched_scheduler.main import create_app
from gpusched_scheduler.settings import SchedulerSettings

if __name__ == "__main__":
    run_service("scheduler", SchedulerSettings, create_app)
