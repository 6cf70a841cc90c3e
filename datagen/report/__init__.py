"""``datagen report``: what a job produced, and whether its records are token-exact training data.

Modules: ``build`` (`build_report`: one streaming pass over the committed records, read through
:mod:`datagen.records.reader` as the exports read them, and the checks), ``stats`` (fixed-bin length
histograms), ``conversations`` (how the conversations of a multi-turn ``all`` job went: the report's
``conversations`` section), ``arms`` (a job with a recipe: the report's ``arms`` section, by arm),
``render`` (the terminal view, report.json, PNG histograms and report.html).
"""

from datagen.report.build import Check, CheckStatus, JobReport, build_report
from datagen.report.render import print_report, write_report

__all__ = ["Check", "CheckStatus", "JobReport", "build_report", "print_report", "write_report"]
