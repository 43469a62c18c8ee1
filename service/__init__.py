"""The service's processes: `serve` (the REST API of `api/` plus dispatchers) and `dispatch`
(dispatchers only). A dispatcher takes experiments from the SQL queue
(`failbench_ray.storage.queue`) and runs them with the engine (`failbench_ray`).

Layering (checked by import-linter in `make lint`): `service` may use `api` and the engine;
`api` may use the engine but not `service`; the engine uses neither, except that its CLI starts
them."""
