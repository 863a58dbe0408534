"""What a run reports: the step's metrics under verl's names (``metrics``) and the backends that record
them, from the console to wandb, with the learning curve at the end (``loggers``)."""
