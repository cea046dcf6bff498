"""``elmo bench``, the benchmark a user runs (elmo.bench.run), and the figures every benchmark reports the same way
(elmo.bench.figures: percentiles, the machine). The repository's development benchmarks (bench/, not installed)
import those figures from here, so an installed ``elmo bench`` and a bench script count alike."""
