"""Healthy programs of pytorch/examples' families, tiny and on the CPU, as new users
tried them: a language model, an actor-critic agent, a linear regression on raw features.
Each is silent where its rules do not apply (no warning, no error) and says so once,
beside the bug the same rule still names."""

from __future__ import annotations

import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from _models import fit, problems
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

# -- a language model ---------------------------------------------------------------------
VOCAB, BPTT, STREAMS = 200, 35, 20


def text(tokens: int = 40 * BPTT * STREAMS + STREAMS, seed: int = 0) -> torch.Tensor:
    """A token stream of Zipfian words (the rarest of 200 has 1/200 of the commonest's
    share), each word's successor mostly fixed (a language to learn), batchified as
    word_language_model does: ``STREAMS`` columns of consecutive text."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, VOCAB + 1)
    p /= p.sum()
    follows = rng.choice(VOCAB, size=VOCAB, p=p)
    words = [0]
    for _ in range(tokens - 1):
        words.append(follows[words[-1]] if rng.random() < 0.7 else rng.choice(VOCAB, p=p))
    return torch.tensor(words).view(STREAMS, -1).t().contiguous()


class Chunks(Dataset):
    """word_language_model's ``get_batch``: ``BPTT`` rows of the text, the targets the
    next tokens, flattened to ``(BPTT * STREAMS,)``."""

    def __init__(self, data: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        self.data, self.labels = data, labels

    def __len__(self) -> int:
        return (len(self.data) - 1) // BPTT

    def __getitem__(self, i: int):
        x = self.data[i * BPTT : (i + 1) * BPTT]
        if self.labels is not None:  # a classifier of each chunk's streams
            return x, self.labels[i * STREAMS : (i + 1) * STREAMS]
        return x, self.data[i * BPTT + 1 : (i + 1) * BPTT + 1].reshape(-1)


class RNNModel(L.LightningModule):
    """word_language_model's RNNModel: an embedding, an LSTM, a decoder over the same
    vocabulary (``classes``: a classifier of the chunks' streams instead)."""

    def __init__(self, classes: int = VOCAB) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 32)
        self.rnn = nn.LSTM(32, 32)
        self.decoder = nn.Linear(32, classes)
        self.classes = classes

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.rnn(self.encoder(x))
        if self.classes != VOCAB:
            out = out[-1]  # a chunk's stream, read to its end
        return nn.functional.cross_entropy(self.decoder(out).reshape(-1, self.classes), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_language_models_next_tokens_are_no_classes():
    """A new user's trial: "class 71 never appears", and the advice to weight the loss by
    class, on word frequencies."""
    data = DataLoader(Chunks(text()), batch_size=None)  # in the text's order, on purpose
    with pytest.warns(RuntimeWarning, match="a language model") as said:
        _, sink = fit(RNNModel(), steps=24, data=data)
    (warning,) = [w for w in said if "language model" in str(w.message)]
    assert "class_imbalance and unshuffled_data" in str(warning.message)
    assert problems(sink) == []


def test_a_classifier_of_the_same_tokens_is_still_told_its_labels_are_imbalanced():
    rng = np.random.default_rng(1)
    rare = rng.integers(1, 4, 40 * STREAMS)
    labels = torch.from_numpy(np.where(rng.random(40 * STREAMS) < 0.96, 0, rare))
    data = DataLoader(Chunks(text(), labels), batch_size=None)
    _, sink = fit(RNNModel(classes=4), steps=30, data=data)  # 500 labels by step 25
    (found,) = sink.by_detector("class_imbalance")
    assert found.severity == "warning" and "weight the loss by class" in found.message


# -- an actor-critic agent --------------------------------------------------------------------
class CartPole:
    """The cart-pole of Barto, Sutton and Anderson (1983), as gym's CartPole-v1 has it."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def reset(self) -> np.ndarray:
        self.s, self.t = self.rng.uniform(-0.05, 0.05, 4), 0
        return self.s.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, bool]:
        x, v, th, w = self.s
        push = (10.0 if action else -10.0) + 0.05 * w * w * math.sin(th)
        alpha = (9.8 * math.sin(th) - math.cos(th) * push / 1.1) / (
            0.5 * (4 / 3 - 0.1 * math.cos(th) ** 2 / 1.1)
        )
        accel = push / 1.1 - 0.05 * alpha * math.cos(th) / 1.1
        self.s = np.array([x + 0.02 * v, v + 0.02 * accel, th + 0.02 * w, w + 0.02 * alpha])
        self.t += 1
        done = abs(self.s[0]) > 2.4 or abs(self.s[2]) > 0.2095 or self.t >= 500
        return self.s.astype(np.float32), done


class Episodes(IterableDataset):
    """One episode per batch, played with the agent's current policy: ``(states, actions,
    returns)``, the returns discounted and standardised, as actor_critic.py has them."""

    def __init__(self, agent: ActorCritic, episodes: int) -> None:
        self.agent, self.episodes = agent, episodes

    def __iter__(self):
        env = CartPole(0)
        for _ in range(self.episodes):
            s, states, actions, done = env.reset(), [], [], False
            while not done:
                with torch.no_grad():
                    logits, _ = self.agent(torch.from_numpy(s))
                actions.append(int(torch.distributions.Categorical(logits=logits).sample()))
                states.append(s)
                s, done = env.step(actions[-1])
            returns = 0.99 ** torch.arange(len(actions), 0, -1.0)  # reward 1 a step
            returns = (1 - returns) / 0.01
            returns = (returns - returns.mean()) / (returns.std() + 1e-7)
            yield torch.from_numpy(np.stack(states)), torch.tensor(actions), returns


class ActorCritic(L.LightningModule):
    """actor_critic.py's Policy (128 ReLU units, an action head and a value head) and its
    loss, -log_prob x advantage plus the critic's smooth L1, summed over the episode."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.action_head, self.value_head = nn.Linear(128, 2), nn.Linear(128, 1)

    def forward(self, x):
        h = torch.relu(self.affine1(x))
        return self.action_head(h), self.value_head(h).squeeze(-1)

    def training_step(self, batch, batch_idx):
        states, actions, returns = batch
        logits, values = self(states)
        log_prob = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
        actor = -(log_prob * (returns - values.detach())).sum()
        return actor + nn.functional.smooth_l1_loss(values, returns, reduction="sum")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-2)


def test_an_actor_critic_agent_is_left_to_its_game():
    """A new user's trial: the agent's actions taken for class labels (unshuffled_data),
    the units its states never excite for dead ones, and a divergence error on a loss
    that grows with the episodes' length (measured on this agent: unshuffled_data at
    step 23, dead_relu at 82, unstable_loss's error at 177)."""
    torch.manual_seed(543)
    agent = ActorCritic()
    data = DataLoader(Episodes(agent, 130), batch_size=None)
    _, sink = fit(agent, steps=130, data=data)
    assert problems(sink) == []
    said = {f.detector for f in sink.findings if f.severity == "info" and "both signs" in f.message}
    assert said == {"loss_spike", "loss_not_decreasing", "unstable_loss", "dead_relu"}
    # an (x, y, ...) of three holds no labels: none was read
    assert sink.by_detector("class_imbalance") == sink.by_detector("unshuffled_data") == []


def test_an_agents_gradient_that_grows_with_its_episodes_is_no_explosion():
    """The loss is summed over the episode, the batch: an episode 10x longer than the last
    ones has a gradient 10x theirs, and no larger per sample (was: exploding_gradients'
    warning at step 31 of this agent, as it began to balance). Said once, an info."""
    torch.manual_seed(5)
    agent = ActorCritic()
    data = DataLoader(Episodes(agent, 40), batch_size=None)
    _, sink = fit(agent, steps=40, data=data)
    assert problems(sink) == []
    (said,) = sink.by_detector("exploding_gradients")
    assert said.severity == "info" and "per sample" in said.message


# -- a linear regression on raw features ---------------------------------------------------------
class Polynomial(L.LightningModule):
    """regression/main.py: a linear model fitted to x, x^2, ..., x^degree of x ~ N(0, 1)
    (the example's degree is 4)."""

    def __init__(self, degree: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(degree, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.smooth_l1_loss(self.fc(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _linear_fit(features: torch.Tensor):
    y = features @ torch.linspace(0.5, -0.2, features.shape[1]) + 0.1
    data = DataLoader(torch.utils.data.TensorDataset(features, y), batch_size=32, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, sink = fit(Polynomial(features.shape[1]), steps=16, data=data)
    return sink


def test_the_examples_four_raw_polynomial_features_are_left_alone():
    """x, x^2, x^3, x^4 (RMS 1, 1.7, 3.9 and 10): the typical of four features is their
    median, 2.8; their 90th percentile, 8.3, is the largest feature's alone (was a warning)."""
    x = torch.randn(512, 1, generator=torch.Generator().manual_seed(0))
    sink = _linear_fit(torch.cat([x**i for i in range(1, 5)], 1))
    assert sink.by_detector("unnormalized_input") == []


def test_a_linear_models_raw_features_are_not_said_to_saturate_it():
    # four features in raw units, RMS 1, 10, 100 and 1000: a median of 55
    x = torch.randn(512, 4, generator=torch.Generator().manual_seed(0))
    sink = _linear_fit(x * torch.tensor([1.0, 10.0, 100.0, 1000.0]))
    (found,) = sink.by_detector("unnormalized_input")
    assert "the typical (median) input feature" in found.message
    # there is no tanh nor sigmoid for it to saturate
    assert "so the first layer starts saturated" not in found.message
    assert "ill-conditioned" in found.message and "standardise each feature" in found.message
