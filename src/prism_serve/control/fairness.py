"""Fair share among the tenants of one priority class, by tokens.

Each (class, tenant) pair keeps two rates of tokens, exponentially weighted: what it *asks* for (a
request's prompt tokens when it arrives; half-life ``asks_half_life_s``, 10 s, so a flood shows
within seconds) and what it is *served* (its prompt tokens and output tokens when it leaves, if it
was dispatched by its deadline: goodput; half-life ``half_life_s``, 30 s, a steadier measure of
what the class's devices deliver). A request's output tokens count in its asks when it leaves.
A tenant's fair part is weighted max-min fair over its class's service: ``part_i = min(asks_i,
level * weight_i)``, with ``level`` set so that the parts sum to the service. A tenant asking for
less than the others gets all it asks for, and the service it leaves is split among the others by
weight. Tenants with less than ``ACTIVE_FRACTION`` of the class's asks (and not the one asking)
are not counted.

``level`` is how far a tenant is over its part when one of its requests arrives: 0 while it asks
for at most ``SLACK`` times its part, else 1 more per doubling, at most ``LEVELS - 1``; once over,
it stays over until it asks for at most ``RECOVERED`` times its part (hysteresis: a tenant cut
back does not swing back to flooding the moment its cut-back service lets its part catch up;
and not 1, since service counts only requests dispatched by their deadline, so a tenant with a
few late requests always asks a little more than it is served). The control loop stamps each
arriving request with it (``Request.share``), device queues re-rank what they hold by each
tenant's latest level (``current``), drop the higher levels first under overload and start them
only on idle capacity (control/admission.py), so a tenant that floods a model loses its own
requests before another tenant of its class loses any. When the class's demand fits, its
service equals its asks and every part is what the tenant asks for: nobody is over and admission
is plain Algorithm 2. A tenant alone in its class is never over, and no tenant is over during
its class's warm-up (the asks' first half-life: a rate needs some history to mean anything).

The decay needs no per-tenant update over time: counts are kept in units that grow as
``exp(t / tau)`` (one per half-life), read back as rates with the correction for a class counted
for less than its window, and rebased before they overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prism_serve.control.types import InvalidKnobError, Origin, Priority

__all__ = ["ACTIVE_FRACTION", "LEVELS", "RECOVERED", "SLACK", "FairShare"]

LEVELS = 4  # share levels 0..3 (admission.py packs them with the class into one rank)
SLACK = 1.5  # a tenant is over its part only past this multiple of it
RECOVERED = 1.2  # ... and stays over until it asks at most this multiple of it
ACTIVE_FRACTION = 0.01  # a tenant with less of its class's recent asks is not counted as sharing
TARGET = 0.99  # a tenant with fewer of its requests on time is hurt: others over their part yield
PEAK_HALF_LIFE_S = 300.0  # the held peak of the service interactive and standard share decays so
_REBASE = 600.0  # rebase the units when their exponent passes this (exp(700) overflows a float)


@dataclass(slots=True)
class _Tenant:
    weight: float
    asked: float = 0.0  # tokens, in units of exp(t / tau_asked) since ``FairShare._base``
    served: float = 0.0  # tokens, in units of exp(t / tau_served)
    over: bool = False  # asked past SLACK times its part, and not back within RECOVERED times since
    level: int = 0  # the level its last arrival got (``FairShare.current``)
    on_time: float = 0.0  # its requests that left with their first token by the deadline (decayed
    left: float = 0.0  # as the asks are), and all its requests that left

    def hurt(self) -> bool:
        """Its requests miss their first-token deadline: fewer than TARGET of those that left
        lately had their first token on time."""
        return self.left > 0 and self.on_time < TARGET * self.left


class FairShare:
    """Recent tokens served per tenant of each class, and each tenant's level (module docstring)."""

    def __init__(self, half_life_s: float = 30.0, asks_half_life_s: float = 10.0) -> None:
        for h in (half_life_s, asks_half_life_s):
            if not (h > 0 and math.isfinite(h)):
                raise InvalidKnobError("fair share half-lives must be > 0")
        self._tau_served = half_life_s / math.log(2)
        self._tau_asked = asks_half_life_s / math.log(2)
        self._base: float | None = None  # the time units are counted from
        self._warm_up = max(half_life_s, asks_half_life_s)
        self._classes: dict[Priority, dict[str, _Tenant]] = {p: {} for p in Priority}
        self._since: dict[Priority, float] = {}  # each class's first ask: its warm-up starts there
        self._standard_over = False  # the standard class, against what interactive leaves
        self._peak, self._peak_at = 0.0, None  # the two classes' highest recent service (tokens/s)

    def _units(self, now: float) -> tuple[float, float]:
        """What a token asked and a token served at ``now`` count (each count's unit grows with
        its own time constant)."""
        if self._base is None:
            self._base = now
        age = now - self._base
        if age / min(self._tau_asked, self._tau_served) > _REBASE:
            # scale every count down to the new base: each count's ratios are unchanged
            shrink_asked, shrink_served = math.exp(-age / self._tau_asked), math.exp(-age / self._tau_served)
            for tenants in self._classes.values():
                for t in tenants.values():
                    t.asked *= shrink_asked
                    t.served *= shrink_served
                    t.on_time *= shrink_asked
                    t.left *= shrink_asked
            self._base, age = now, 0.0
        return math.exp(age / self._tau_asked), math.exp(age / self._tau_served)

    def _tenant(self, origin: Origin) -> _Tenant:
        tenants = self._classes[origin.priority]
        t = tenants.get(origin.tenant)
        if t is None:
            t = tenants[origin.tenant] = _Tenant(origin.weight)
        else:
            t.weight = origin.weight  # the keys file may have changed it
        return t

    def charge(self, origin: Origin, *, asked: int = 0, served: int = 0, now: float) -> None:
        """Tokens more asked for by, and served to, ``origin``'s tenant in its class."""
        if asked > 0 or served > 0:
            t, (unit_asked, unit_served) = self._tenant(origin), self._units(now)
            t.asked += asked * unit_asked
            t.served += served * unit_served

    def left(self, origin: Origin, prompt_tokens: int, output_tokens: int, on_time: bool, now: float) -> None:
        """A request left its engine: it asked for its output tokens too, was served its prompt
        and output, and its first token came by its deadline or not."""
        self.charge(origin, asked=output_tokens, served=prompt_tokens + output_tokens, now=now)
        unit = self._units(now)[0]
        t = self._tenant(origin)
        t.on_time += on_time * unit
        t.left += unit

    def level(self, origin: Origin, now: float) -> int:
        """How far ``origin``'s tenant is over its part (module docstring): of its class, and for
        a standard tenant, of what interactive traffic leaves (the class's own level, if higher)."""
        self._since.setdefault(origin.priority, now)
        me = self._tenant(origin)
        units = self._units(now)
        level = self._tenant_level(origin.priority, me, now, units)
        if origin.priority is Priority.STANDARD:
            level = max(level, self._class_level(now, units))
        me.level = level
        return level

    def current(self, origin: Origin) -> int:
        """The level ``origin``'s tenant got at its latest arrival (0 for a tenant not seen): what
        a device queue re-ranks the requests it holds by."""
        t = self._classes[origin.priority].get(origin.tenant)
        return 0 if t is None else t.level

    def _rates(
        self, priority: Priority, now: float, units: tuple[float, float]
    ) -> tuple[float, float] | None:
        """Per token counted in ``priority``'s class: the tokens/s it stands for, asked and served
        (a decayed count is its rate times its time constant, times the part of its window the
        class has been counted for: the bias of a young average, corrected); None while the class
        warms up."""
        since = self._since.get(priority)
        age = -math.inf if since is None else now - since
        if age < self._warm_up:
            return None
        return (
            1.0 / (units[0] * self._tau_asked * -math.expm1(-age / self._tau_asked)),
            1.0 / (units[1] * self._tau_served * -math.expm1(-age / self._tau_served)),
        )

    def _tenant_level(self, priority: Priority, me: _Tenant, now: float, units: tuple[float, float]) -> int:
        tenants = self._classes[priority]
        rates = self._rates(priority, now, units)
        if len(tenants) < 2 or rates is None:
            return 0  # alone, or its class's service not measured yet (module docstring)
        per_asked, per_served = rates
        asked = sum(t.asked for t in tenants.values()) * per_asked
        service = sum(t.served for t in tenants.values()) * per_served
        if me.asked <= 0 or service <= 0:
            return 0
        floor = ACTIVE_FRACTION * asked
        others = [t for t in tenants.values() if t is not me and t.asked * per_asked >= floor]
        if not others:
            return 0
        mine = me.asked * per_asked
        active = [(t.asked * per_asked, t.weight, False) for t in others] + [(mine, me.weight, True)]
        part = _max_min(active, service, mine, me.weight)
        # and only while another of its class asks less for its weight (SLACK times less to become
        # over, RECOVERED times to stay): the tenant asking least is never over, so tenants that
        # ask alike never all are (each would be cut back for the others, and the service
        # measured while they are cut back would keep them so)
        least = min(t.asked / t.weight for t in others)
        smaller = least * (RECOVERED if me.over else SLACK) < me.asked / me.weight
        me.over = _over(me.over, mine, part) and smaller
        return _level(me.over, mine, part)

    def _class_level(self, now: float, units: tuple[float, float]) -> int:
        """The standard class's level against what interactive traffic leaves of the two classes'
        service (interactive is served first: its asks come off the top)."""
        both = (Priority.INTERACTIVE, Priority.STANDARD)
        rates = [self._rates(p, now, units) for p in both]
        if None in rates or not self._classes[Priority.INTERACTIVE]:
            return 0
        asked, served = [0.0, 0.0], 0.0
        for i, (p, (per_asked, per_served)) in enumerate(zip(both, rates, strict=True)):
            asked[i] = sum(t.asked for t in self._classes[p].values()) * per_asked
            served += sum(t.served for t in self._classes[p].values()) * per_served
        # what the two classes can be served: the highest recent service, held while it decays
        # slowly (service alone would fall with the standard requests cut back, and keep them cut)
        if self._peak_at is not None:
            self._peak *= 0.5 ** ((now - self._peak_at) / PEAK_HALF_LIFE_S)
        self._peak, self._peak_at = max(self._peak, served), now
        if asked[1] <= 0 or served <= 0:
            return 0
        part = max(0.0, self._peak - asked[0])
        # cut standard back only once interactive requests miss (the held peak is only an
        # estimate of what the devices can do); then until standard asks for what is left and
        # interactive requests are on time again
        hurt = any(t.hurt() for t in self._classes[Priority.INTERACTIVE].values())
        was = self._standard_over
        self._standard_over = (_over(was, asked[1], part) and (was or hurt)) or (was and hurt)
        return _level(self._standard_over, asked[1], part)

    def forget_idle(self, now: float) -> None:
        """Drop tenants whose recent asks decayed to nothing (bounds the tables); a class with
        none left warms up again."""
        unit = self._units(now)[0]
        for priority, tenants in self._classes.items():
            for name in [n for n, t in tenants.items() if t.asked < 1e-3 * unit]:
                del tenants[name]
            if not tenants:
                self._since.pop(priority, None)
        if not self._classes[Priority.INTERACTIVE]:  # nothing left for standard to yield to
            self._standard_over, self._peak, self._peak_at = False, 0.0, None


def _over(was: bool, asks: float, part: float) -> bool:
    """Over its part: past SLACK times it, or over before and not back within RECOVERED."""
    ratio = asks / part if part > 0 else math.inf
    return ratio > SLACK or (was and ratio > RECOVERED)


def _level(over: bool, asks: float, part: float) -> int:
    if not over:
        return 0
    ratio = asks / part if part > 0 else math.inf
    if ratio == math.inf:
        return LEVELS - 1
    return min(LEVELS - 1, 1 + max(0, int(math.log2(ratio / SLACK))))


def _max_min(tenants: list[tuple[float, float, bool]], service: float, mine: float, weight: float) -> float:
    """The weighted max-min fair part of ``service`` of the tenant marked in ``tenants``, each
    (asks, weight, is it), capped by their asks; ``mine`` and ``weight``: its own."""
    left, weights = service, sum(w for _, w, _ in tenants)
    for asks, w, me in sorted(tenants, key=lambda t: t[0] / t[1]):
        if asks > left * w / weights:  # it and every tenant after it get the level the rest allows
            return weight * left / weights  # the marked one is among them, or it returned below
        if me:
            return mine
        left -= asks
        weights -= w
    return mine
