"""gpusched router: OpenAI-compatible HTTP front door that publishes requests to Kafka."""
