"""One router per resource: experiments, sweeps, and the service itself (health, metrics,
registry, recommend). `api.app.create_app` includes them."""
