"""A door: ``ft_client.timeouts_calc`` is where the learning's math lived before it moved into
its room, ``ft_client.learning.calc``; docs and user code may still name it here, as the
reference names its ``timeouts_calc``. The module's public names, and the reference's
calculator API (`TimeoutsCalc`, ...), import from here. Nothing is defined here."""

from ft_client.learning.calc import DEFAULT_SAFETY_FACTOR as DEFAULT_SAFETY_FACTOR
from ft_client.learning.calc import MISSING as MISSING
from ft_client.learning.calc import SAFETY_FACTOR_RULE as SAFETY_FACTOR_RULE
from ft_client.learning.calc import NotEnoughDataError as NotEnoughDataError
from ft_client.learning.calc import Observations as Observations
from ft_client.learning.calc import TimeoutsRecorder as TimeoutsRecorder
from ft_client.learning.calc import check_safety_factor as check_safety_factor
from ft_client.learning.calc import hb_not_ready as hb_not_ready
from ft_client.learning.calc import learn_hb_timeouts as learn_hb_timeouts
from ft_client.learning.calc import learn_section_timeouts as learn_section_timeouts
from ft_client.learning.calc import safety_factor_ok as safety_factor_ok
from ft_client.learning.calc import sections_not_ready as sections_not_ready
from ft_client.learning.compat import SectionAction as SectionAction
from ft_client.learning.compat import TimeoutsCalc as TimeoutsCalc
from ft_client.learning.compat import TimeoutsCalcError as TimeoutsCalcError
from ft_client.learning.compat import TimeoutsCalcNotReadyError as TimeoutsCalcNotReadyError
