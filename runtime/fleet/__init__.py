"""The fleet view: workers announce themselves; the API, ``epd status`` and ``/metrics``
read the fleet, the lag of every consumer group and the dead letters."""
