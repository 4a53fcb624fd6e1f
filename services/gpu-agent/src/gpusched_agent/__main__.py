"""`python -m gpusched_agent`: run a GPU agent with settings from the environment."""

from gpusched_agent.main import create_app
from gpusched_agent.settings import AgentSettings
from gpusched_common.web import serve

if __name__ == "__main__":
    settings = AgentSettings()
    serve(create_app(settings), settings)
