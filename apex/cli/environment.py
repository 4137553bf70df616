"""The environment variables that stand for `apex` flags."""

# Every flag that a container may rather set through the environment.
ENV = {
    "config": "APEX_CONFIG",
    "logdir": "APEX_LOGDIR",
    "bind_host": "APEX_BIND_HOST",
    "port": "APEX_PORT",
    "learner": "APEX_LEARNER",
    "actor_index": "APEX_ACTOR_INDEX",
    "num_envs": "APEX_NUM_ENVS",
    "curve_dir": "APEX_CURVE_DIR",
    "resume": "APEX_RESUME",
}
