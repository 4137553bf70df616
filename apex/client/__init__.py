"""``PolicyClient``: a Python client of `apex serve` over ZeroMQ/msgpack, for simulators that
step themselves and want actions from the policy apex is training.

    from apex.client import PolicyClient

    with PolicyClient("tcp://127.0.0.1:8001") as client:
        episode = client.start_episode()
        action = client.get_action(episode, obs)
        client.log_returns(episode, reward)
        ...
        client.end_episode(episode, obs, terminated=True)

``HttpPolicyClient`` has the same methods over HTTP/JSON (the server's ``--http``, the
standard library's keep-alive connection), for where ZeroMQ cannot go.

Each call is one request and waits for its reply (``timeout_s``, then TimeoutError). The
batched forms (``start_episodes``, ``get_actions``, ``log_actions``, ``log_returns_many``,
``end_episodes``) carry many episodes in one request: that is how a vectorised simulator
reaches tens of thousands of steps a second. Errors the server names raise
``PolicyServerError`` with its status (400, 401, 404, 409, 429, 503) and message. No apex
dependencies beyond pyzmq, msgpack and NumPy: the package (apex/client/) can be copied into a
simulator's code.
"""

from apex.client.http_client import HttpPolicyClient
from apex.client.wire import PolicyServerError
from apex.client.zmq_client import PolicyClient

__all__ = ["HttpPolicyClient", "PolicyClient", "PolicyServerError"]
