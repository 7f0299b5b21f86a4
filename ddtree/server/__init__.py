"""The OpenAI-compatible HTTP server (`ddtree serve`): protocol models, the engine on a background
thread bridged to asyncio, Prometheus metrics, and the FastAPI app. Imported only by `ddtree serve`,
so the offline API does not need the server's dependencies loaded."""
