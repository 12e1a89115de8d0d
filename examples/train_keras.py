"""A Keras 3 training script (torch backend); trainmon from ``trainmon-run`` or its callback.

    trainmon-run -- python examples/train_keras.py --epochs 3            # no change to the code
    python examples/train_keras.py --epochs 3 --trainmon-callback        # callbacks=[...]

A small dense network fits a fixed function of its input with ``model.fit`` (validation data,
a learning-rate schedule), on CPU. ``--history FILE`` writes ``fit``'s history and the batch
size as JSON, for the tests.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--history", default=None)
    p.add_argument(
        "--trainmon-callback", action="store_true", help="callbacks=[TrainmonCallback()]"
    )
    args = p.parse_args(argv)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 8)).astype("float32")
    y = np.tanh(x.sum(axis=1, keepdims=True)).astype("float32")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=10, decay_rate=0.9)
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
    callbacks = []
    if args.trainmon_callback:
        from trainmon_client.keras import TrainmonCallback

        callbacks.append(TrainmonCallback())
    history = model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_split=0.25,
        callbacks=callbacks,
        verbose=0,
    )
    if args.history:
        with open(args.history, "w") as f:
            json.dump({"history": history.history, "batch_size": args.batch_size}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
