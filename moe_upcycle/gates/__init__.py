"""Router weights: random, embedding and hidden-state gates, k-means, and checks on the result."""
