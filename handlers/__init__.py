"""Event handlers: one concern per module, each attached as
``handler.attach(trainer, evaluator=None)`` (``handlers.handler``). Import each from the module
that defines it (``from handlers.early_stopping import EarlyStopping``): a run loads only the
handlers it uses."""
