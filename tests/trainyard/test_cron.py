import pytest
from dagster._utils.schedules import is_valid_cron_string

from trainyard.cron import is_valid_cron

CASES = [
    "0 3 * * *", "*/15 * * * *", "0 0 1 1 *", "0 9-17 * * MON-FRI", "0 0 * * 0", "0 0 * * 7", "5,10,15 * * * *",
    "0 0 29 2 *", "0 0 30 2 *", "0 0 31 2 *", "0 0 30,31 2 *", "0 0 28,30 2 *", "0 12 * JAN,JUL *", "0 0 1-31/2 * *",
    "@daily", "@hourly", "@weekly", "@monthly", "@yearly", "@annually", "@midnight",
    "", "* * * *", "* * * * * *", "60 * * * *", "* 24 * * *", "* * 0 * *", "* * 32 * *", "* * * 13 *", "* * * * 8",
    "5-1 * * * *", "*/0 * * * *", "a * * * *", "0 3 * * FUNDAY", "0 0 * * sun", "1-5/2 * * * *", "3/20 * * * *",
    "*-5 * * * *", "0 0 ? * *", "@reboot", "0 0 L * *", "0 22-2 * * *", "0 0 * * 1#2", "0 0 * * 1#9", "0 0 ? * ?",
]


@pytest.mark.parametrize("cron", CASES)
def test_agrees_with_dagsters_validator(cron):
    assert is_valid_cron(cron) == is_valid_cron_string(cron)
