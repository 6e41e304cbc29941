"""The training engine: one process function, on an Ignite ``Engine``. Import each name from
the module that defines it (``from engine.trainer import create_trainer``)."""
