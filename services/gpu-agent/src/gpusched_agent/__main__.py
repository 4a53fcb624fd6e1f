"""`python -m gpusched_agent`: run a GPU agent with settings from the environment."""

from gpusched_agent.main import create_app
from gpusched_agent.settings import AgentSettings
from gpusched_common.web import run_service

if __name__ == "__main__":
    run_service("gpu-agent", AgentSettings, create_app)
