"""Fed2: upper layers split into groups that each serve their own classes, averaged group by group (docs/fed2.md)."""
