"""The trainer: `launch(config)` starts the ranks (launch.py, what `burst train` calls); each runs `train(config)`
(train.py), which runs the phases of a Trainer (trainer.py: set-up, resume, step, save, finish), one optimizer step
being step.py; TrainConfig (config.py) holds every setting. Nothing is imported here, so that `burst --help` can
read TrainConfig without importing torch."""
