"""Step 0: the single-process Keras 3 program that examples/digits_keras.py migrates.

Runs on its own (``python examples/digits_single.py``); no Horovod, no MLflow.
"""

from __future__ import annotations

import keras

# Same data and model as the migrated program, so the two differ only by the migration.
from digits_keras import build_model, load_data


def main(epochs: int = 5, batch_size: int = 32, learning_rate: float = 0.001) -> float:
    x_train, y_train, x_test, y_test = load_data()
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
              validation_data=(x_test, y_test))
    return float(model.evaluate(x_test, y_test, verbose=0)[1])


if __name__ == "__main__":
    print(f"test accuracy: {main():.3f}")
