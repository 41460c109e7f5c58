"""The HTTP server process's side of the backend: routes, hint ingress, chat inference, tenants, pause
clocks. It reaches the schedulers only through control messages (:mod:`sgl_agentcache.server.control`)."""
