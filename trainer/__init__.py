"""The trainer: `train(config)` runs one rank (train.py); `launch(config)` starts the ranks (launch.py, what
`burst train` calls); TrainConfig (config.py) holds every setting. Nothing is imported here, so that
`burst --help` can read TrainConfig without importing torch."""
