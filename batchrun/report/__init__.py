"""A job's report: one offline HTML file of its progress, answers, accuracy against labels, pace and errors, with
charts drawn by matplotlib as inline SVG (imported on first use, not with batchrun).
"""
from batchrun.report.build import default_report_path, is_report, render_report, write_report
from batchrun.report.comparison import comparison_page, write_comparison
from batchrun.report.data import ReportData, Rows, read_job

__all__ = ["ReportData", "Rows", "comparison_page", "default_report_path", "is_report", "read_job", "render_report",
           "write_comparison", "write_report"]
