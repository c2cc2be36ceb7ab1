"""The floor every other subpackage stands on; imports nothing else of the project.

    runtime.py        the environment of every process (loopback Ray / Serve / Mooncake, offline hub, vLLM CPU
                      settings, malloc tunables), the work folder, ``init_ray``
    file_lock.py      OS locks that die with their holder, bounded waits, atomic writes, temporaries swept
    config_cli.py     a config dataclass <-> ``--flags`` / ``--config file.yaml``
    config_fields.py  field helpers shared by the stage configs
"""
