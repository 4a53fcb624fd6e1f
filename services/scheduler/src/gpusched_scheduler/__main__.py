"""`python -m gpusched_scheduler`: run the scheduler with settings from the environment."""

from gpusched_common.web import serve
from gpusched_scheduler.main import create_app
from gpusched_scheduler.settings import SchedulerSettings

if __name__ == "__main__":
    settings = SchedulerSettings()
    serve(create_app(settings), settings)
