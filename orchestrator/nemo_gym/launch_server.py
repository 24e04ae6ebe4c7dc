"""Runs one NeMo Gym server: ``python launch_server.py ENTRYPOINT`` with NeMo Gym's interpreter (its
own venv; this file imports nothing of orch), in the server's directory, its config in
``NEMO_GYM_CONFIG_DICT`` and its instance name in ``NEMO_GYM_CONFIG_PATH`` (as NeMo Gym's own
launcher passes them).

NeMo Gym starts a Ray cluster in every server it starts (dozens of processes, some in sessions of
their own, which outlive a killed server); a server that does not use Ray needs none. Without
``ray_head_node_address`` in the config, that start is skipped here; with one, the server joins
that cluster, as under NeMo Gym's launcher.
"""

import os
import runpy
import sys

import nemo_gym.server_utils as server_utils
from omegaconf import OmegaConf

config = OmegaConf.create(os.environ["NEMO_GYM_CONFIG_DICT"])
if not config.get("ray_head_node_address"):
    server_utils.initialize_ray = lambda: None  # run_webserver's only use of Ray
sys.path.insert(0, os.getcwd())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
