"""The course: what an instructor and a learner use around the notebooks.

    editions       the workbook (`make lab`) and student (`make student`) editions, and
                   `titanlite progress`
    reading_order  the core's files in the order the notebooks teach them, with their statements

May import the core and this package's own top (the moved names `make lab` reports)."""
