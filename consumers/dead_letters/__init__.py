"""Dead letters: the writer the consume loop hands a failed record to, the reader behind
``epd dlq list/show``, and replay (``epd dlq replay``)."""
