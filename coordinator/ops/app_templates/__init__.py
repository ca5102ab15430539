"""The apps ``fedge-coordinator new`` starts a user from: each a working app, written against the app interface
alone, whose data needs no download (scikit-learn's bundled sets or a generated one) so it trains at once."""
