"""Step 0: the single-process Keras 3 program that examples/digits_keras.py migrates.

Runs on its own (``python examples/digits_single.py``); no Horovod, no MLflow.
"""

from __future__ import annotations

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (1797 images, offline), scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def build_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


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
