"""Downstream evaluation data: the offline mini-suite of SC, TC, QA and IR tasks and its loader."""
