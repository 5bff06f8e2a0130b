"""The server's routes, one ``APIRouter`` module per endpoint group; ``api_server.build_app``
mounts them. Each route takes its typed request body (``request_body.typed_body``) and the
shared ``ServerState`` (``server_state.State``); errors it raises are mapped in ``errors.py``."""
